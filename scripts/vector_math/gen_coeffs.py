"""Derive the minimax coefficients used in vector_math.cpp.

usage: gen_coeffs.py NAME [NAME...]   (or 'all')
Prints C++ initializers (hex floats) and the weighted max error (log2) of
the rounded coefficients.  Results are cached in coeffs.json.
"""
import json
import os
import sys

import mpmath as mp
from remez import check, fit_fixed, hexs

mp.mp.dps = 80
S = mp.sqrt
E = mp.mpf


def sq(z):
    return mp.sqrt(z)


FITS = {}


def reg(name, g, w, a, b, n, flt=False, m=2500, nfix=2):
    FITS[name] = dict(g=g, w=w, a=a, b=b, n=n, flt=flt, m=m, nfix=nfix)


# ---------------- double ----------------
LN2 = mp.log(2)
# exp(r) = 1 + r + r^2/2 + r^3 P(r), |r| <= ln2/2 (+margin)
reg('exp_d', lambda r: (mp.exp(r) - 1 - r - r * r / 2) / r**3,
    lambda r: abs(r)**3 / mp.exp(r), -0.3470, 0.3470, 10)
# 2^r = 1 + r P(r), |r| <= 0.5
reg('exp2_d', lambda r: (mp.power(2, r) - 1) / r, lambda r: abs(r) / mp.power(2, r), -0.5002, 0.5002, 13)
# log1p(f) = 2s + s^3 R(s^2), s = f/(2+f), s^2 <= 0.029437
ZL = (mp.sqrt(2) - 1)**2 / (mp.sqrt(2) + 1)**2 * E('1.0001')
reg('log_d', lambda z: (2 * mp.atanh(sq(z)) - 2 * sq(z)) / (z * sq(z)), lambda z: z / 2, None, ZL, 7)
# precise tail for pow: R(z) = 2/3 + 2z/5 + z^2 R3(z)
reg('logp_d', lambda z: ((2 * mp.atanh(sq(z)) - 2 * sq(z)) / (z * sq(z)) - E(2) / 3 - 2 * z / 5) / z**2,
    lambda z: z**3 / 2, ZL * E('1e-6'), ZL, 7)
PI4 = mp.pi / 4 * E('1.0001')
reg('sin_d', lambda z: (mp.sin(sq(z)) - sq(z)) / (z * sq(z)), lambda z: z * sq(z) / mp.sin(sq(z)), None, PI4**2, 7)
reg('cos_d', lambda z: (mp.cos(sq(z)) - 1 + z / 2) / z**2, lambda z: z**2 / mp.cos(sq(z)), None, PI4**2, 7)
reg('tan_d', lambda z: (mp.tan(sq(z)) - sq(z)) / (z * sq(z)), lambda z: z * sq(z) / mp.tan(sq(z)), None, PI4**2, 16)
reg('tan2_d', lambda z: (mp.tan(sq(z)) - sq(z) - z * sq(z) / 3) / (z * z * sq(z)), lambda z: z * z * sq(z) / mp.tan(sq(z)), None, PI4**2, 15, nfix=1)
reg('asin_d', lambda z: (mp.asin(sq(z)) - sq(z)) / (z * sq(z)), lambda z: z * sq(z) / mp.asin(sq(z)), None, E('0.2501'), 13)
reg('atan_d', lambda z: (mp.atan(sq(z)) - sq(z)) / (z * sq(z)), lambda z: z * sq(z) / mp.atan(sq(z)), None, E('0.4376')**2, 12)
reg('sinh_d', lambda z: (mp.sinh(sq(z)) - sq(z)) / (z * sq(z)), lambda z: z * sq(z) / mp.sinh(sq(z)), None, E('1.0001'), 8)
reg('tanh_d', lambda z: (mp.tanh(sq(z)) - sq(z)) / (z * sq(z)), lambda z: z * sq(z) / mp.tanh(sq(z)), None, E('0.2501')**2, 9)
reg('erf_d', lambda z: mp.erf(sq(z)) / sq(z) - 1, lambda z: sq(z) / mp.erf(sq(z)), None, E('0.2501'), 10, nfix=0)
# sin(pi r) = pi r + r^3 K(r^2), |r| <= 0.5 (lgamma reflection)
reg('sinpi_d', lambda z: (mp.sin(mp.pi * sq(z)) - mp.pi * sq(z)) / (z * sq(z)),
    lambda z: z * sq(z) / mp.sin(mp.pi * sq(z)), None, E('0.2501'), 10)
# lgamma(2+t) = t P(t), |t| <= 0.5
reg('lgam_d', lambda t: mp.loggamma(2 + t) / t, lambda t: abs(t / mp.loggamma(2 + t)), E('-0.5001'), E('0.5001'), 20, nfix=0)
FITS['lgam_d']['dd2'] = True
# Stirling tail: S(x) = (1/x) B(1/x^2), x >= 8
def _stir(v):
    x = 1 / sq(v)
    return (mp.loggamma(x) - (x - E(1) / 2) * mp.log(x) + x - mp.log(2 * mp.pi) / 2) * x
reg('stir_d', _stir, lambda v: 1 / (mp.loggamma(1 / sq(v)) * sq(v)) , E('1e-30'), E(1) / 64, 7)


def _Q(x):
    return mp.erfc(x) * mp.exp(x * x)


# erfc(x) = exp(-x^2) Q(x); piecewise polynomials in u = x - c
ERFC_IV = [(E('0.5'), E('1')), (E('1'), E('2')), (E('2'), E('3.5')), (E('3.5'), E('6'))]
for i, (lo, hi) in enumerate(ERFC_IV):
    c = (lo + hi) / 2
    reg('erfc%d_d' % i, (lambda c: lambda u: _Q(c + u))(c), (lambda c: lambda u: 1 / _Q(c + u))(c),
        lo - c - E('1e-6'), hi - c + E('1e-6'), 17, nfix=0)
# x >= 6: Q(x) = (1/x) G(1/x^2)
reg('erfc4_d', lambda v: _Q(1 / sq(v)) / sq(v), lambda v: sq(v) / _Q(1 / sq(v)), 1 / E('27.5')**2, 1 / E(36), 17, nfix=0)


# ---------------- float ----------------
reg('exp_f', lambda r: (mp.exp(r) - 1 - r - r * r / 2) / r**3,
    lambda r: abs(r)**3 / mp.exp(r), -0.3470, 0.3470, 4, flt=True)


reg('log_f', lambda z: (2 * mp.atanh(sq(z)) - 2 * sq(z)) / (z * sq(z)), lambda z: z / 2, None, ZL, 3, flt=True, nfix=1)
reg('expd9_d', lambda r: (mp.exp(r) - 1 - r - r * r / 2) / r**3,
    lambda r: abs(r)**3 / mp.exp(r), -0.3470, 0.3470, 9)
# ---- double kernels with float-level accuracy (float functions via double) ----
reg('sin_fd', lambda z: (mp.sin(sq(z)) - sq(z)) / (z * sq(z)), lambda z: z * sq(z) / mp.sin(sq(z)), None, PI4**2, 4, nfix=1)
reg('cos_fd', lambda z: (mp.cos(sq(z)) - 1 + z / 2) / z**2, lambda z: z**2 / mp.cos(sq(z)), None, PI4**2, 4, nfix=1)
reg('tan_fd', lambda z: (mp.tan(sq(z)) - sq(z)) / (z * sq(z)), lambda z: z * sq(z) / mp.tan(sq(z)), None, PI4**2, 8, nfix=1)


# erfc(x) = exp(-x^2) Q(x): 7 pieces in u = x - c, and (1/x) G(1/x^2) beyond 7
ERFC8 = [(E('0.5'), E('1')), (E('1'), E('1.5')), (E('1.5'), E('2')), (E('2'), E('2.75')), (E('2.75'), E('3.75')),
         (E('3.75'), E('5')), (E('5'), E('6.5'))]
for i, (lo, hi) in enumerate(ERFC8):
    c = (lo + hi) / 2
    reg('erfq%d_d' % i, (lambda c: lambda u: _Q(c + u))(c), (lambda c: lambda u: 1 / _Q(c + u))(c),
        lo - c - E('1e-6'), hi - c + E('1e-6'), 15, nfix=0)
reg('erfq7_d', lambda v: _Q(1 / sq(v)) / sq(v), lambda v: sq(v) / _Q(1 / sq(v)), 1 / E('27.6')**2, 1 / E('6.5')**2, 15, nfix=0)


# float erf (evaluated in double): piece 0 erf(x) = x P(x^2) on [0, 1/2);
# pieces 1..7: erf(c + u) on [k/2, k/2 + 1/2), c = k/2 + 1/4 (k = 1..7)
reg('erff0_fd', lambda z: mp.erf(sq(z)) / sq(z), lambda z: sq(z) / mp.erf(sq(z)), None, E('0.2501'), 9, nfix=0)
for k in range(1, 8):
    c = E(k) / 2 + E(1) / 4
    reg('erff%d_fd' % k, (lambda c: lambda u: mp.erf(c + u))(c), (lambda c: lambda u: 1 / mp.erf(c + u))(c),
        E('-0.2501'), E('0.2501'), 9, nfix=0)
reg('tanh_fd', lambda z: (mp.tanh(sq(z)) - sq(z)) / (z * sq(z)), lambda z: z * sq(z) / mp.tanh(sq(z)), None, E('0.5501')**2, 7, nfix=1)
reg('exp_fd', lambda r: (mp.exp(r) - 1 - r - r * r / 2) / r**3,
    lambda r: abs(r)**3 / mp.exp(r), -0.3470, 0.3470, 5, nfix=1)


reg('lgam_fd', lambda t: mp.loggamma(2 + t) / t, lambda t: abs(t / mp.loggamma(2 + t)), E('-0.5001'), E('0.5001'), 12, nfix=0)
reg('stir_fd', _stir, lambda v: 1 / (mp.loggamma(1 / sq(v)) * sq(v)), E('1e-30'), E(1) / 64, 3, nfix=0)


T8 = mp.tan(mp.pi / 8) * E('1.0001')
reg('atan_fd', lambda z: (mp.atan(sq(z)) - sq(z)) / (z * sq(z)), lambda z: z * sq(z) / mp.atan(sq(z)), None, T8**2, 7, nfix=1)
reg('sinh_fd', lambda z: (mp.sinh(sq(z)) - sq(z)) / (z * sq(z)), lambda z: z * sq(z) / mp.sinh(sq(z)), None, E('0.5001')**2, 4, nfix=1)


def show(name, res):
    f = FITS[name]
    print('// %s: n=%d up to %s, weighted max err 2^%.2f (rounded: 2^%.2f)' % (
        name, f['n'], mp.nstr(f['b'], 6), res['log2e'], res['log2e_r']))
    print('static const %s C_%s[%d] = {%s};' % ('float' if f['flt'] else 'double', name.upper(), f['n'],
                                               ', '.join(hexs(v, f['flt']) for v in res['c'])))


def run(name):
    f = FITS[name]
    a = f['a'] if f['a'] is not None else E(f['b']) * E('1e-7')
    cr, e = fit_fixed(f['g'], f['w'], a, f['b'], f['n'], nfix=f.get('nfix', 2), flt=f['flt'], m=f['m'])
    res = dict(c=cr, log2e=float(mp.log(e, 2)))
    if f['nfix'] == 0:
        # leading coefficient as a double-double (hi = cr[0], lo below)
        lo = float(fit_fixed.last_mp[0] - mp.mpf(cr[0]))
        res['c0lo'] = lo
        lo1 = 0.0
        if f.get('dd2'):
            lo1 = float(fit_fixed.last_mp[1] - mp.mpf(cr[1]))
            res['c1lo'] = lo1
        g0 = lambda x: f['g'](x) - mp.mpf(lo) - mp.mpf(lo1) * x
        er = check(g0, f['w'], a, f['b'], cr, m=8000)
    else:
        er = check(f['g'], f['w'], a, f['b'], cr, m=8000)
    res['log2e_r'] = float(mp.log(er, 2))
    return res


if __name__ == '__main__':
    CF = os.environ.get('COEFFS', 'coeffs.json')
    cache = json.load(open(CF)) if os.path.exists(CF) else {}
    names = sys.argv[1:]
    force = False
    if names and names[0] == '-f':
        force = True
        names = names[1:]
    if names == ['all']:
        names = list(FITS)
    for n in names:
        if force or n not in cache or cache[n].get('n') != FITS[n]['n']:
            r = run(n)
            r['n'] = FITS[n]['n']
            cache[n] = r
            json.dump(cache, open(CF, 'w'), indent=1)
        show(n, cache[n])
