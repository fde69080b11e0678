# Table for the log used by pow: 64 subintervals of m in [sqrt(1/2), sqrt(2))
# indexed by the top 6 bits of (bits(x) - bits(sqrt(1/2))); per entry
# [c, -log(c) hi, -log(c) lo, 0] with c ~ 1/m (c = 1 on the interval holding 1).
import struct

import mpmath as mp

mp.mp.dps = 50
OFF = 0x3fe6a09e667f3bcd
def d(b): return struct.unpack('<d', struct.pack('<Q', b))[0]
rows = []; rmax = 0
for j in range(64):
    lo = d(OFF + j * 2**46); hi = d(OFF + (j + 1) * 2**46 - 1)
    if lo <= 1.0 <= hi:
        c = 1.0
    else:
        c = 2 / (lo + hi)
        e = mp.floor(mp.log(c, 2)); sc = mp.mpf(2)**(11 - e)
        c = float(mp.nint(c * sc) / sc)
    rmax = max(rmax, abs(lo * c - 1), abs(hi * c - 1))
    L = -mp.log(c); h = float(L); l = float(L - h)
    rows.append((c, h, l))
print('// rmax = %.6g' % rmax)
print('alignas(32) static const double LOGT[64][4] = {%s};' % ',\n  '.join('{%s, %s, %s, 0.0}' % (a.hex(), b.hex(), c.hex()) for a, b, c in rows))
smax = rmax / (2 - rmax)
print('// smax^2 = %r' % (smax * smax))
