"""Minimax polynomial fitting (Remez exchange) with mpmath, used to derive the
coefficients in vector_math.cpp.

fit(g, w, a, b, n): find c[0..n-1] minimizing max over [a,b] of
|w(x) * (g(x) - sum c_j x^j)|.  g and w are mpmath functions.
Returns (coefficients as mpf, max weighted error estimate).
"""
import mpmath as mp

mp.mp.dps = 60


def _grid(a, b, m):
    # Chebyshev-clustered grid (dense near the ends, where extrema crowd).
    return [(a + b) / 2 - (b - a) / 2 * mp.cos(mp.pi * i / (m - 1)) for i in range(m)]


def _peval(c, x):
    s = mp.mpf(0)
    for cj in reversed(c):
        s = s * x + cj
    return s


def fit(g, w, a, b, n, m=3000, iters=40, verbose=False, basis=None):
    a = mp.mpf(a)
    b = mp.mpf(b)
    if basis is None:
        basis = lambda j, x: x ** j
    grid = _grid(a, b, m)
    gv = [g(x) for x in grid]
    wv = [w(x) for x in grid]
    # initial reference: n+1 Chebyshev extrema
    ref = [int(round((m - 1) * (1 - mp.cos(mp.pi * i / n)) / 2)) for i in range(n + 1)]
    ref = sorted(set(ref))
    while len(ref) < n + 1:
        ref.append(ref[-1] + 1)
    best = None
    for it in range(iters):
        A = mp.matrix(n + 1, n + 1)
        rhs = mp.matrix(n + 1, 1)
        for i, k in enumerate(ref):
            x = grid[k]
            for j in range(n):
                A[i, j] = basis(j, x)
            A[i, n] = (-1) ** i / wv[k]
            rhs[i] = gv[k]
        sol = mp.lu_solve(A, rhs)
        c = [sol[j] for j in range(n)]
        E = abs(sol[n])
        err = [wv[k] * (gv[k] - sum(c[j] * basis(j, grid[k]) for j in range(n))) for k in range(m)]
        # split into runs of equal sign, take the extremum of each run
        runs = []
        cur = [0]
        for k in range(1, m):
            if (err[k] >= 0) == (err[cur[-1]] >= 0):
                cur.append(k)
            else:
                runs.append(cur)
                cur = [k]
        runs.append(cur)
        ext = [max(r, key=lambda k: abs(err[k])) for r in runs]
        # reduce to n+1 alternating points: drop smallest while too many
        while len(ext) > n + 1:
            # drop the smaller end, or merge smallest interior pair
            if abs(err[ext[0]]) < abs(err[ext[-1]]):
                cand_end = 0
            else:
                cand_end = len(ext) - 1
            # smallest interior adjacent pair
            pi = min(range(len(ext) - 1), key=lambda i: min(abs(err[ext[i]]), abs(err[ext[i + 1]])))
            pv = min(abs(err[ext[pi]]), abs(err[ext[pi + 1]]))
            if len(ext) - (n + 1) >= 2 and pv < abs(err[ext[cand_end]]) and 0 < pi < len(ext) - 2:
                del ext[pi:pi + 2]
            else:
                del ext[cand_end]
        maxerr = max(abs(e) for e in err)
        if best is None or maxerr < best[1]:
            best = (c, maxerr)
        if verbose:
            print(it, mp.nstr(E, 8), mp.nstr(maxerr, 8), len(ext))
        if len(ext) < n + 1:
            break
        minext = min(abs(err[k]) for k in ext)
        ref = ext
        if (maxerr - minext) / maxerr < mp.mpf('1e-5'):
            break
    return best


def check(g, w, a, b, coeffs, m=20000, basis=None):
    """Max weighted error of the given (rounded) coefficients on a fine grid."""
    if basis is None:
        basis = lambda j, x: x ** j
    a = mp.mpf(a)
    b = mp.mpf(b)
    worst = mp.mpf(0)
    for x in _grid(a, b, m):
        p = sum(mp.mpf(cj) * basis(j, x) for j, cj in enumerate(coeffs))
        e = abs(w(x) * (g(x) - p))
        if e > worst:
            worst = e
    return worst


def to_double(c):
    return [float(x) for x in c]


def to_float(c):
    import numpy as np
    return [float(np.float32(float(x))) for x in c]


def hexs(v, flt=False):
    s = float(v).hex()
    return s + ('f' if flt else '')


def fit_fixed(g, w, a, b, n, nfix=2, flt=False, m=3000):
    """Fit, then round the leading nfix coefficients one at a time, refitting
    the rest each time (so the rounding error of the big leading terms is
    absorbed by the others).  Returns rounded coefficient list."""
    rnd = (lambda v: to_float([v])[0]) if flt else float
    fixed = []
    for k in range(nfix + 1):
        def gk(x, fixed=list(fixed)):
            s = g(x)
            for j, c in enumerate(fixed):
                s -= mp.mpf(c) * x ** j
            return s / x ** len(fixed)

        def wk(x, nf=len(fixed)):
            return w(x) * abs(x) ** nf
        c, e = fit(gk, wk, a, b, n - len(fixed), m=m)
        if k == nfix:
            fit_fixed.last_mp = c
            return fixed + [rnd(v) for v in c], e
        fixed.append(rnd(c[0]))
