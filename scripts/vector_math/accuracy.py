"""Accuracy test for vector_math.cpp.

For every function, precision (float, double) and runnable width (SSE2 f4/d2,
AVX2 f8/d4) the exported cr_sl_* function is evaluated on
  (a) a random sweep: log-uniform magnitudes of both signs over the whole
      exponent range (denormals included) plus uniform sweeps over the common
      range and function-specific hard ranges;
  (b) a list of edge values (zeros, infinities, NaN, denormals, thresholds).
References: glibc long double (64-bit significand) on every point, and mpmath
(80 digits) on a random subsample for the double functions (and a smaller one
for float).  Errors are in ULPs of the correctly rounded result.

Build the two libraries first, from the repository root:

    g++ -O2 -std=c++17 -fPIC -shared cuda_runner/native/vector_math.cpp -o scripts/vector_math/libvm.so
    g++ -O2 -std=c++17 -fPIC -shared scripts/vector_math/accuracy_driver.cpp -o scripts/vector_math/testlib.so

usage: accuracy.py [--quick] [func ...]     results -> results.json (needs mpmath)
"""
import ctypes
import json
import math
import os
import sys
import time

import mpmath as mp
import numpy as np

mp.mp.dps = 50

HERE = os.path.dirname(os.path.abspath(__file__))
LIB = os.environ.get("VMLIB", os.path.join(HERE, "libvm.so"))
tl = ctypes.CDLL(os.path.join(HERE, 'testlib.so'))
vm = ctypes.CDLL(LIB)
P = ctypes.c_void_p
for fn in ('run_f4', 'run_d2', 'run_f8', 'run_d4'):
    getattr(tl, fn).argtypes = [P, ctypes.c_int, P, P, P, ctypes.c_long]
tl.ref_ld.argtypes = [ctypes.c_char_p, P, P, P, ctypes.c_long]
tl.ref_ld.restype = ctypes.c_int
tl.nextafter_f.argtypes = [P, P, P, ctypes.c_long]
tl.nextafter_d.argtypes = [P, P, P, ctypes.c_long]

LD = np.longdouble
INF = float('inf')
NAN = float('nan')

# name, arity, suffixes, bound (ULP), common range, extra ranges
FUNCS = {
    'exp': (1, ['_u10'], 1.0, (-100, 100), dict(f=[(80, 89), (-104, -86)], d=[(700, 710), (-746, -700)])),
    'exp2': (1, ['_u10'], 1.0, (-140, 140), dict(f=[(120, 128.5), (-151, -120)], d=[(1015, 1025), (-1080, -1015)])),
    'expm1': (1, ['_u10'], 1.0, (-5, 5), dict(f=[(-1, 1), (-20, 89)], d=[(-1, 1), (-40, 710)])),
    'log': (1, ['_u10'], 1.0, (0, 10), dict(f=[(0.5, 2)], d=[(0.5, 2)])),
    'log2': (1, ['_u10'], 1.0, (0, 10), dict(f=[(0.5, 2)], d=[(0.5, 2)])),
    'log10': (1, ['_u10'], 1.0, (0, 10), dict(f=[(0.5, 2)], d=[(0.5, 2)])),
    'log1p': (1, ['_u10'], 1.0, (-1, 10), dict(f=[(-0.5, 0.5)], d=[(-0.5, 0.5)])),
    'sin': (1, ['_u10', '_u35'], 1.0, (-10, 10), dict(f=[(-1e4, 1e4)], d=[(-1e6, 1e6)])),
    'cos': (1, ['_u10', '_u35'], 1.0, (-10, 10), dict(f=[(-1e4, 1e4)], d=[(-1e6, 1e6)])),
    'tan': (1, ['_u10'], 1.0, (-10, 10), dict(f=[(-1e4, 1e4)], d=[(-1e6, 1e6)])),
    'asin': (1, ['_u10'], 1.0, (-1, 1), {}),
    'acos': (1, ['_u10'], 1.0, (-1, 1), {}),
    'atan': (1, ['_u10'], 1.0, (-10, 10), {}),
    'sinh': (1, ['_u10'], 1.0, (-10, 10), dict(f=[(80, 90), (-1, 1)], d=[(700, 711), (-1, 1)])),
    'cosh': (1, ['_u10'], 1.0, (-10, 10), dict(f=[(80, 90)], d=[(700, 711)])),
    'tanh': (1, ['_u10'], 1.0, (-5, 5), dict(f=[(-0.6, 0.6), (5, 20)], d=[(-0.6, 0.6), (5, 40)])),
    'asinh': (1, ['_u10'], 1.0, (-10, 10), dict(f=[(-1, 1)], d=[(-1, 1)])),
    'acosh': (1, ['_u10'], 1.0, (1, 10), dict(f=[(1, 1.01)], d=[(1, 1.0001)])),
    'atanh': (1, ['_u10'], 1.0, (-1, 1), dict(f=[(0.99, 1)], d=[(0.9999, 1)])),
    'erf': (1, ['_u10'], 1.0, (-5, 5), dict(f=[(-1, 1)], d=[(-1, 1)])),
    'erfc': (1, ['_u15'], 1.5, (-3, 10), dict(f=[(5, 11)], d=[(5, 28)])),
    'lgamma': (1, ['_u10'], 1.0, (-10, 10), dict(f=[(0, 3), (-5, 0)], d=[(0, 3), (-5, 0)])),
    'atan2': (2, ['_u10'], 1.0, (-10, 10), {}),
    'pow': (2, ['_u10'], 1.0, (0, 10), {}),
    'hypot': (2, ['_u05'], 0.5, (-10, 10), {}),
    'fmod': (2, [''], 0.0, (-10, 10), {}),
    'nextafter': (2, [''], 0.0, (-10, 10), {}),
    'copysign': (2, [''], 0.0, (-10, 10), {}),
}
# Domain used for the log-uniform part (positive only, etc.)
POSONLY = {'log', 'log2', 'log10', 'acosh'}
F32 = dict(dt=np.float32, p=24, emin=-126, emax=127, lmin=-149, lmax=128, max=float(np.finfo(np.float32).max))
F64 = dict(dt=np.float64, p=53, emin=-1022, emax=1023, lmin=-1074, lmax=1024, max=float(np.finfo(np.float64).max))


def logu(rng, n, T, pos=False):
    e = rng.uniform(T['lmin'], T['lmax'], n)
    v = np.exp2(e.astype(np.float64))
    v = v.astype(T['dt'])
    if not pos:
        v = v * rng.choice(np.array([-1, 1], dtype=T['dt']), n)
    return v


def gen_inputs(name, prec, n, rng):
    ar, sfx, bound, common, extra = FUNCS[name]
    T = F32 if prec == 'f' else F64
    dt = T['dt']
    parts = []
    n4 = n // 4
    parts.append(logu(rng, n4 * 2, T, pos=name in POSONLY))
    parts.append(rng.uniform(common[0], common[1], n4).astype(dt))
    ex = extra.get(prec, [])
    rest = n - 2 * n4 * 1 - n4
    for i, (a, b) in enumerate(ex):
        k = rest // len(ex) if i < len(ex) - 1 else rest - (rest // len(ex)) * (len(ex) - 1)
        parts.append(rng.uniform(a, b, k).astype(dt))
    if not ex:
        parts.append(rng.uniform(common[0], common[1], rest).astype(dt))
    x = np.concatenate(parts)
    if ar == 1:
        return x, None
    # two-argument functions: mix of log-uniform, common range, and special pairings
    y = np.concatenate([logu(rng, n4 * 2, T), rng.uniform(common[0], common[1], n - 2 * n4).astype(dt)])
    if name == 'pow':
        m = n // 8
        x[:m] = rng.uniform(0, 3, m).astype(dt)
        y[:m] = rng.uniform(-300 if prec == 'd' else -60, 300 if prec == 'd' else 60, m).astype(dt)
        x[m:2 * m] = (1 + rng.uniform(-1e-3, 1e-3, m)).astype(dt)
        y[m:2 * m] = logu(rng, m, T)
        x[2 * m:3 * m] = -rng.uniform(0, 10, m).astype(dt)
        y[2 * m:3 * m] = np.round(rng.uniform(-40, 40, m)).astype(dt)
        x[3 * m:4 * m] = np.abs(x[3 * m:4 * m])
    if name == 'hypot':
        m = n // 4
        y[:m] = x[:m] * rng.uniform(0.5, 2, m).astype(dt)
    if name == 'fmod':
        m = n // 4
        y[:m] = rng.uniform(-10, 10, m).astype(dt)
    if name == 'nextafter':
        m = n // 4
        y[:m] = x[:m]
    rng.shuffle(perm := np.arange(n))
    return x[perm], y[perm]


def edge_values(name, prec):
    T = F32 if prec == 'f' else F64
    mx = T['max']
    tiny = float(np.finfo(T['dt']).tiny)
    den = tiny / 2 ** (T['p'] - 1)
    basic = [0.0, -0.0, INF, -INF, NAN, 1.0, -1.0, 0.5, -0.5, 2.0, -2.0, den, -den, tiny, -tiny, tiny / 3, -tiny / 3,
             mx, -mx, 1e-30, -1e-30, 1e30, -1e30, 3.0, -3.0, 10.0, -10.0]
    if prec == 'd':
        basic += [1e-300, -1e-300, 1e300, -1e300, 1e-200, 1e200]
    spec = {
        'exp': [88.72283, 88.72284, 88.7229, 89.0, -87.33654, -103.972, -103.9721, -104.0, 709.78, 709.782712893384,
                709.7827128933841, 710.0, -708.39, -745.13, -745.1332191019411, -745.2, -746.0],
        'exp2': [127.999, 128.0, -126.0, -149.0, -149.5, -150.0, 1023.9999, 1024.0, -1022.0, -1074.0, -1075.0, 0.5],
        'expm1': [1e-10, -1e-10, 1e-40, -1e-40, 88.72, 88.8, 709.78, 710.0, -20, -40, -100, 0.3466, -0.3466],
        'log1p': [-0.9999999, -1 + 1e-10, 1e-10, -1e-10, 1e-40, -1e-40, -2.0],
        'sin': [1e22, 1e30, -1e30, 3.14159265358979, 1.5707963267948966, 6381956970095103 * 2.0**797, 1e6, 1e15,
                104.0, 355.0, 1e38, 3.4e38],
        'cos': [1e22, 1e30, -1e30, 3.14159265358979, 1.5707963267948966, 6381956970095103 * 2.0**797, 1e6, 1e15,
                104.0, 355.0, 1e38, 3.4e38],
        'tan': [1e22, 1e30, -1e30, 1.5707963267948966, 1.5707963, -1.5707963, 7.853981633974483, 1e6, 1e15, 1e38],
        'asin': [1.0000001, -1.0000001, 0.9999999, 1e-20],
        'acos': [1.0000001, -1.0000001, 0.9999999, -0.9999999, 1e-20],
        'atan': [1e20, -1e20, 0.4375, 0.6875, 1.1875, 2.4375],
        'sinh': [88.7, 89.4, 89.5, 90.0, 709.7, 710.4, 710.5, 711.0, 1e-20],
        'cosh': [88.7, 89.4, 89.5, 90.0, 709.7, 710.4, 710.5, 711.0, 1e-20],
        'tanh': [1e-20, 0.25, 0.55, 9.0, 9.1, 19.0, 19.1, 20.0, 22.0, 40.0],
        'asinh': [1e20, -1e20, 1e-20, 1e154, 1e308],
        'acosh': [1.0000001, 1 + 2**-52, 0.9999, 1e20, 1e154, 1e308],
        'atanh': [0.9999999, -0.9999999, 1.0000001, 1e-20, 1 - 2**-53],
        'erf': [1e-20, -1e-20, 0.5, 1.0, 2.0, 3.5, 3.9, 4.0, 5.9, 6.0, 6.1],
        'erfc': [1e-20, 0.5, 1.0, 2.0, 3.5, 6.0, 9.0, 10.0, 10.05, 10.06, 26.0, 26.5, 27.0, 27.2, 27.3, 28.0, -6.0,
                 -28.0],
        'lgamma': [1.0, 2.0, -1.0, -2.0, -100.0, -2.5, -2.4570247, -2.7476826, -3.1435972, -3.9552783, 1e-20,
                   -1e-20, 4e36, 2e305, 2.55e305, 2.6e305, 0.5, 1.5, 2.5, -0.5, -1.5, 1e10, -1e10, -2**52 - 0.5,
                   -2**23 - 0.5, -4503599627370495.5, 1 + 1e-9, 2 + 1e-9, 1 - 1e-9, 2 - 1e-9],
    }
    v = basic + spec.get(name, [])
    ar = FUNCS[name][0]
    v = np.array(v, dtype=T['dt'])
    v = v[~(np.isinf(v) & ~np.isinf(np.array(basic + spec.get(name, []), dtype=np.float64)))] if prec == 'f' else v
    if ar == 1:
        return v, None
    # pairs
    pairs = []
    pl = [0.0, -0.0, INF, -INF, NAN, 1.0, -1.0, 2.0, -2.0, 0.5, -0.5, 3.0, -3.0, den, tiny, mx, -mx]
    for a in pl:
        for b in pl:
            pairs.append((a, b))
    if name == 'pow':
        pairs += [(-8.0, 1 / 3), (-2.0, 3.0), (-2.0, -3.0), (0.0, -1.0), (-0.0, -3.0), (-0.0, 3.0), (-0.0, -2.0),
                  (1.0, NAN), (NAN, 0.0), (-1.0, INF), (-1.0, -INF), (2.0, 1024.0), (2.0, 1023.999), (2.0, -1074.0),
                  (2.0, -1075.0), (10.0, 308.0), (10.0, 309.0), (10.0, -323.0), (10.0, -324.0), (2.0, 127.9999),
                  (2.0, 128.0), (2.0, -149.0), (2.0, -150.0), (-2.0, 0.5), (-INF, 3.0), (-INF, -3.0), (-INF, 2.0),
                  (0.5, INF), (0.5, -INF), (2.0, INF), (2.0, -INF), (-0.5, INF), (1.0000001, 1e9), (0.9999999, 1e9),
                  (1 + 2**-52, 2.0**60), (-3.0, 2.0**60), (-3.0, 2.0**60 + 1), (-1.0, 2.0**53 + 1.0), (-1.0, 1e300)]
    if name == 'hypot':
        pairs += [(INF, NAN), (NAN, INF), (-INF, NAN), (NAN, -INF), (3.0, 4.0), (mx, mx), (den, den), (den, 3 * den),
                  (tiny, tiny), (1e-310, 1e-310), (1e300, 1e300), (1e-300, 1e300)]
    if name == 'atan2':
        pairs += [(1.0, 1e-300), (1e-300, 1.0), (1e300, 1e-300), (1e-300, -1.0), (den, -1.0), (1.0, -1e300)]
    if name == 'fmod':
        pairs += [(1e300, 3.0), (mx, den), (5.5, 1.5), (-5.5, 1.5), (5.5, -1.5), (1e20, 0.1), (den * 7, den * 2),
                  (3.0, INF), (INF, 3.0), (3.0, 0.0)]
    if name == 'nextafter':
        pairs += [(0.0, -1.0), (-0.0, 1.0), (den, 0.0), (-den, 0.0), (tiny, 0.0), (mx, INF), (1.0, 1.0), (0.0, 0.0),
                  (-0.0, 0.0), (0.0, -0.0)]
    if prec == 'f':
        pairs = [(a, b) for a, b in pairs if not ((abs(a) > 3.5e38 and abs(a) != INF) or (abs(b) > 3.5e38 and abs(b) != INF))]
    a = np.array([p[0] for p in pairs], dtype=T['dt'])
    b = np.array([p[1] for p in pairs], dtype=T['dt'])
    return a, b


def call(name, sfx, prec, width, x, y):
    lanes = {'f4': 4, 'd2': 2, 'f8': 8, 'd4': 4}[width]
    sym = 'cr_sl_%s%s%s' % (name, width, sfx)
    addr = ctypes.cast(getattr(vm, sym), ctypes.c_void_p).value
    n = len(x)
    pad = (-n) % lanes
    dt = x.dtype
    xx = np.ascontiguousarray(np.concatenate([x, np.ones(pad, dt)]))
    yy = np.ascontiguousarray(np.concatenate([y, np.ones(pad, dt)])) if y is not None else xx
    out = np.empty_like(xx)
    getattr(tl, 'run_' + width)(addr, 1 if y is None else 2, xx.ctypes.data, yy.ctypes.data, out.ctypes.data,
                                len(xx))
    return out[:n]


def ref_ld(name, x, y):
    xl = np.ascontiguousarray(x.astype(LD))
    yl = np.ascontiguousarray(y.astype(LD)) if y is not None else xl
    o = np.empty_like(xl)
    if name == 'nextafter':
        out = np.empty_like(x)
        f = tl.nextafter_f if x.dtype == np.float32 else tl.nextafter_d
        f(np.ascontiguousarray(x).ctypes.data, np.ascontiguousarray(y).ctypes.data, out.ctypes.data, len(x))
        return out.astype(LD)
    r = tl.ref_ld(name.encode(), xl.ctypes.data, yl.ctypes.data, o.ctypes.data, len(x))
    assert r == 0, name
    if name == 'pow':
        # powl(x, y) for float args is exact enough; nothing to fix
        pass
    return o


def mp_ref(name, a, b=None):
    a = mp.mpf(float(a))
    if b is not None:
        b = mp.mpf(float(b))
    f = {
        'exp': mp.exp, 'exp2': lambda v: mp.power(2, v), 'expm1': mp.expm1, 'log': mp.log,
        'log2': lambda v: mp.log(v, 2), 'log10': mp.log10, 'log1p': mp.log1p, 'sin': mp.sin, 'cos': mp.cos,
        'tan': mp.tan, 'asin': mp.asin, 'acos': mp.acos, 'atan': mp.atan, 'sinh': mp.sinh, 'cosh': mp.cosh,
        'tanh': mp.tanh, 'asinh': mp.asinh, 'acosh': mp.acosh, 'atanh': mp.atanh, 'erf': mp.erf, 'erfc': mp.erfc,
        'lgamma': lambda v: mp.re(mp.loggamma(v)), 'atan2': mp.atan2, 'pow': mp.power, 'hypot': mp.hypot,
    }[name]
    return f(a) if b is None else f(a, b)


def mp_usable(name, a, b=None):
    """mpmath reference only for finite non-special cases."""
    vals = [a] if b is None else [a, b]
    if any(not math.isfinite(float(v)) for v in vals):
        return False
    a = float(a)
    if name in ('log', 'log2', 'log10', 'acosh') and (a <= 0 or (name == 'acosh' and a < 1)):
        return False
    if name in ('asin', 'acos', 'atanh') and abs(a) >= 1:
        return False
    if name == 'log1p' and a <= -1:
        return False
    if name == 'lgamma' and a <= 0 and a == math.floor(a):
        return False
    if name == 'erfc' and a > 1e4:
        return False  # mpmath's erfc overflows internally
    if name == 'pow' and a < 0:
        return False
    if name == 'pow' and a == 0:
        return False
    if name == 'atan2' and (a == 0 or float(b) == 0):
        return False  # signed zeros: mpmath has none
    return True


def ulp_errors(out, ref, T):
    """ULP error of out against long double ref; NaN/inf/sign-of-zero aware.
    Returns (err array, special-mismatch bool array)."""
    dt = T['dt']
    o = out.astype(LD)
    r = ref
    err = np.zeros(len(out), dtype=np.float64)
    bad = np.zeros(len(out), dtype=bool)
    rn = np.isnan(r)
    on = np.isnan(o)
    bad |= rn != on
    fin = ~rn & ~on
    # correctly rounded reference
    with np.errstate(over='ignore', invalid='ignore'):
        cr = r.astype(dt)
    ri = np.isinf(r)
    bad |= fin & ri & (o != r)
    fr = fin & ~ri
    a = np.abs(cr[fr]).astype(LD)
    e = np.floor(np.log2(np.where(a > 0, a, LD(T['max']) if False else LD(1)), dtype=LD))
    e = np.where(np.isinf(a), T['emax'], e)
    e = np.maximum(e, T['emin'])
    ulp = np.exp2(e - (T['p'] - 1), dtype=LD)
    with np.errstate(invalid='ignore', over='ignore'):
        d = np.abs(o[fr] - r[fr])
        ee = (d / ulp).astype(np.float64)
        # results that overflow to inf where the rounded reference is inf too
        both_inf = np.isinf(cr[fr]) & np.isinf(o[fr]) & (np.sign(cr[fr]) == np.sign(o[fr]))
        ee = np.where(both_inf, 0.0, ee)
    err[fr] = ee
    # sign of zero
    z = fr.copy()
    z[fr] = (r[fr] == 0)
    bad |= z & (np.signbit(o) != np.signbit(r))
    return err, bad


def ulp_err_mp(out, refv, T):
    """exact-ish error vs an mpmath value"""
    o = float(out)
    if math.isnan(o):
        return INF
    dt = T['dt']
    cr = float(dt(float(refv))) if abs(refv) < mp.mpf(T['max']) * 2 else INF
    if math.isinf(o):
        if math.isinf(cr) and (o > 0) == (refv > 0):
            return 0.0
        return INF
    a = abs(cr)
    if a == 0:
        e = T['emin']
    elif math.isinf(a):
        e = T['emax']
    else:
        e = max(math.frexp(a)[1] - 1, T['emin'])
    ulp = mp.mpf(2) ** (e - (T['p'] - 1))
    return float(abs(mp.mpf(o) - refv) / ulp)


def test_function(name, nf, nd, nmp_d, nmp_f, widths, seed=1):
    ar, sfxs, bound, common, extra = FUNCS[name]
    res = {}
    for prec in ('f', 'd'):
        T = F32 if prec == 'f' else F64
        rng = np.random.default_rng(seed + (0 if prec == 'f' else 7))
        n = nf if prec == 'f' else nd
        x, y = gen_inputs(name, prec, n, rng)
        ex, ey = edge_values(name, prec)
        ref = ref_ld(name, x, y)
        eref = ref_ld(name, ex, ey)
        # mpmath subsample (finite, ordinary arguments)
        nmp = nmp_d if prec == 'd' else nmp_f
        idx = [i for i in rng.choice(n, min(n, nmp * 2), replace=False)
               if mp_usable(name, x[i], None if y is None else y[i])][:nmp] if name not in ('fmod', 'nextafter', 'copysign') else []
        t0 = time.time()
        mpv = [mp_ref(name, x[i], None if y is None else y[i]) for i in idx]
        tmp = time.time() - t0
        # check long double reference against mpmath
        ld_vs_mp = max([float(abs(mp.mpf(repr(ref[i]).replace('np.longdouble(', '').strip("')")) - v) / (abs(v) if v != 0 else 1))
                        for i, v in zip(idx, mpv) if np.isfinite(ref[i])] or [0])
        for sfx in sfxs:
            for w in widths:
                width = w[0] if prec == 'f' else w[1]
                key = '%s%s%s' % (name, width, sfx)
                out = call(name, sfx, prec, width, x, y)
                err, bad = ulp_errors(out, ref, T)
                eout = call(name, sfx, prec, width, ex, ey)
                eerr, ebad = ulp_errors(eout, eref, T)
                # finite ordinary edge cases: mpmath is the reference (glibc's
                # long double functions miss some worst cases, e.g. cosl)
                if name not in ('fmod', 'nextafter', 'copysign'):
                    for i in range(len(ex)):
                        if mp_usable(name, ex[i], None if ey is None else ey[i]) and np.isfinite(eref[i]) and np.isfinite(eout[i]):
                            eerr[i] = ulp_err_mp(eout[i], mp_ref(name, ex[i], None if ey is None else ey[i]), T)
                emp = [ulp_err_mp(out[i], v, T) for i, v in zip(idx, mpv)]
                # re-check the worst points of the sweep against mpmath (the long
                # double reference itself can be off, e.g. cosl near multiples of pi/2)
                ntop = 20 if bound > 0.5 else 5000  # u05: the long double reference cannot tell 0.5 from 0.4999
                top = [int(i) for i in np.argsort(err)[-ntop:] if np.isfinite(err[i]) and err[i] > 0.45 and
                       mp_usable(name, x[i], None if y is None else y[i])] if name not in ('fmod', 'nextafter', 'copysign') else []
                topv = {}
                for i in top:
                    topv[i] = ulp_err_mp(out[i], mp_ref(name, x[i], None if y is None else y[i]), T)
                err_v = err.copy()
                for i, v in topv.items():
                    err_v[i] = v
                imax = int(np.argmax(err_v))
                extra = {}
                if name == 'lgamma':
                    pos = x > 0
                    extra['max_ulp_pos'] = float(err_v[pos].max())
                    neg = (x < 0) & np.isfinite(ref) & np.isfinite(out)
                    extra['max_ulp_neg'] = float(err_v[neg].max())
                    small = neg & (np.abs(ref) <= 1)
                    extra['max_abs_err_neg'] = float(np.abs(out[small].astype(LD) - ref[small]).max())
                    far = neg & (np.abs(ref) > 0.5)
                    extra['max_ulp_neg_absref_gt_0.5'] = float(err_v[far].max())
                    extra['max_ulp_mp_pos'] = float(max([e for e, i in zip(emp, idx) if x[i] > 0] or [0]))
                r = dict(n=int(n), max_ulp=float(err_v.max()), max_ulp_ldref=float(err.max()), argmax=[float(x[imax])] + ([float(y[imax])] if y is not None else []),
                         out_at_max=float(out[imax]), ref_at_max=float(ref[imax]),
                         mean_ulp=float(err_v[np.isfinite(err_v)].mean()), special_bad=int(bad.sum()),
                         bad_examples=[[float(x[i])] + ([float(y[i])] if y is not None else []) + [float(out[i]), float(ref[i])]
                                       for i in np.nonzero(bad)[0][:5]],
                         n_mp=len(idx), max_ulp_mp=float(max(emp) if emp else 0.0),
                         edge_n=len(ex), edge_max_ulp=float(eerr.max()), edge_bad=int(ebad.sum()),
                         edge_bad_examples=[[float(ex[i])] + ([float(ey[i])] if ey is not None else []) + [float(eout[i]), float(eref[i])]
                                            for i in np.nonzero(ebad | (eerr > bound + 1e-9 if bound > 0 else eerr > 0))[0][:8]],
                         bound=bound, ld_ref_rel_err_vs_mp=float(ld_vs_mp), mp_seconds=tmp,
                         edges=[[float(ex[i])] + ([float(ey[i])] if ey is not None else []) + [float(eout[i]), float(eref[i]), float(eerr[i]), bool(ebad[i])]
                                for i in range(len(ex))], **extra)
                res[key] = r
                print('%-22s max %.4f ulp (mp %.4f, n_mp %d) mean %.4f  special-bad %d  edge max %.3f bad %d  at %s -> %r ref %r' % (
                    key, r['max_ulp'], r['max_ulp_mp'], r['n_mp'], r['mean_ulp'], r['special_bad'], r['edge_max_ulp'], r['edge_bad'],
                    r['argmax'], r['out_at_max'], r['ref_at_max']), flush=True)
                if r['bad_examples']:
                    print('    special mismatches:', r['bad_examples'])
                if r['edge_bad_examples']:
                    print('    edge problems:', r['edge_bad_examples'])
    return res


if __name__ == '__main__':
    args = sys.argv[1:]
    quick = '--quick' in args
    args = [a for a in args if a != '--quick']
    names = args or list(FUNCS)
    nf, nd, nmpd, nmpf = (100000, 20000, 500, 200) if quick else (1000000, 200000, 20000, 3000)
    widths = [('f4', 'd2'), ('f8', 'd4')]
    allres = {}
    if os.path.exists('results.json') and not quick:
        allres = json.load(open('results.json'))
    for nm in names:
        allres.update(test_function(nm, nf, nd, nmpd, nmpf, widths))
        if not quick:
            json.dump(allres, open('results.json', 'w'), indent=1)
