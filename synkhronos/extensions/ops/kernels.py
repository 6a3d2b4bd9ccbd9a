"""CPU kernels of the convolution and pooling Ops: Numba loops around BLAS matrix products.

Every kernel works on channels-last arrays ``(n, h, w, c)`` with weights
``(fh, fw, c // groups, f)``: the innermost loops then run over contiguous
channels, and im2col rows line up with the reshaped weights, so a convolution
is one copy into a column matrix and one GEMM (``np.dot``, which Numba hands
to BLAS).  Channels-first callers pass ``nchw=True`` and the drivers transpose
at the boundary.  Geometry (stride, padding, dilation) is passed at run time,
so one compiled kernel per dtype serves every layer; ``cache=True`` keeps the
compiled kernels on disk between runs.  The drivers are plain ``numba.njit``
functions: the Numba backend calls them from compiled graphs and the Ops'
``perform`` (C and Python linkers) calls them from Python.
"""

import numba
import numpy as np

_JIT = dict(cache=True, nogil=True)


@numba.njit(**_JIT)
def out_len(size, k, s, p, d):
    """Return the output length of a window ``k`` (dilation ``d``) at stride ``s``, padding ``p``."""
    return (size + 2 * p - d * (k - 1) - 1) // s + 1


@numba.njit(**_JIT)
def _im2col(x, c0, cg, fh, fw, sh, sw, ph, pw, dh, dw, oh, ow):
    n, h, w, _ = x.shape
    cols = np.zeros((n * oh * ow, fh * fw * cg), x.dtype)
    for b in range(n):
        for oy in range(oh):
            for ox in range(ow):
                row = (b * oh + oy) * ow + ox
                for i in range(fh):
                    iy = oy * sh - ph + i * dh
                    if iy < 0 or iy >= h:
                        continue
                    for j in range(fw):
                        ix = ox * sw - pw + j * dw
                        if ix < 0 or ix >= w:
                            continue
                        base = (i * fw + j) * cg
                        for k in range(cg):
                            cols[row, base + k] = x[b, iy, ix, c0 + k]
    return cols


@numba.njit(**_JIT)
def _col2im(cols, gx, c0, cg, fh, fw, sh, sw, ph, pw, dh, dw, oh, ow):
    n, h, w, _ = gx.shape
    for b in range(n):
        for oy in range(oh):
            for ox in range(ow):
                row = (b * oh + oy) * ow + ox
                for i in range(fh):
                    iy = oy * sh - ph + i * dh
                    if iy < 0 or iy >= h:
                        continue
                    for j in range(fw):
                        ix = ox * sw - pw + j * dw
                        if ix < 0 or ix >= w:
                            continue
                        base = (i * fw + j) * cg
                        for k in range(cg):
                            gx[b, iy, ix, c0 + k] += cols[row, base + k]


@numba.njit(**_JIT)
def _pointwise(fh, fw, sh, sw, ph, pw):
    # A 1x1, stride-1, unpadded convolution reads the images as they are: no im2col copy.
    return fh == 1 and fw == 1 and sh == 1 and sw == 1 and ph == 0 and pw == 0


@numba.njit(**_JIT)
def _nhwc(x, nchw):
    if nchw:
        return np.ascontiguousarray(x.transpose(0, 2, 3, 1))
    return np.ascontiguousarray(x)


@numba.njit(**_JIT)
def _hwio(w, nchw):
    # Channels-first weights are (f, c, fh, fw); the kernels want (fh, fw, c, f).
    if nchw:
        return np.ascontiguousarray(w.transpose(2, 3, 1, 0))
    return np.ascontiguousarray(w)


@numba.njit(**_JIT)
def _back(y, nchw):
    if nchw:
        return np.ascontiguousarray(y.transpose(0, 3, 1, 2))
    return y


@numba.njit(**_JIT)
def conv_forward(x, w, nchw, sh, sw, ph, pw, dh, dw, groups):
    """Return the cross-correlation of images ``x`` with weights ``w``."""
    x = _nhwc(x, nchw)
    w = _hwio(w, nchw)
    n, h, wd, c = x.shape
    fh, fw, cg, f = w.shape
    fg = f // groups
    oh = out_len(h, fh, sh, ph, dh)
    ow = out_len(wd, fw, sw, pw, dw)
    out = np.empty((n * oh * ow, f), x.dtype)
    for g in range(groups):
        if groups == 1 and _pointwise(fh, fw, sh, sw, ph, pw):
            cols = x.reshape(n * h * wd, c)
        else:
            cols = _im2col(x, g * cg, cg, fh, fw, sh, sw, ph, pw, dh, dw, oh, ow)
        wg = np.ascontiguousarray(w[:, :, :, g * fg:(g + 1) * fg]).reshape(fh * fw * cg, fg)
        if groups == 1:
            np.dot(cols, wg, out)
        else:
            out[:, g * fg:(g + 1) * fg] = np.dot(cols, wg)
    return _back(out.reshape(n, oh, ow, f), nchw)


@numba.njit(**_JIT)
def conv_grad_input(gy, w, nchw, h, wd, sh, sw, ph, pw, dh, dw, groups):
    """Return the gradient wrt the images, of height ``h`` and width ``wd``."""
    gy = _nhwc(gy, nchw)
    w = _hwio(w, nchw)
    n, oh, ow, f = gy.shape
    fh, fw, cg, _ = w.shape
    fg = f // groups
    gy2 = gy.reshape(n * oh * ow, f)
    gx = np.zeros((n, h, wd, cg * groups), gy.dtype)
    for g in range(groups):
        wg = np.ascontiguousarray(w[:, :, :, g * fg:(g + 1) * fg]).reshape(fh * fw * cg, fg)
        gyg = np.ascontiguousarray(gy2[:, g * fg:(g + 1) * fg])
        dcols = np.dot(gyg, np.ascontiguousarray(wg.T))
        if groups == 1 and _pointwise(fh, fw, sh, sw, ph, pw):
            gx = dcols.reshape(n, h, wd, cg)
        else:
            _col2im(dcols, gx, g * cg, cg, fh, fw, sh, sw, ph, pw, dh, dw, oh, ow)
    return _back(gx, nchw)


@numba.njit(**_JIT)
def conv_grad_weights(x, gy, nchw, fh, fw, sh, sw, ph, pw, dh, dw, groups):
    """Return the gradient wrt the weights, in the layout's weight order."""
    x = _nhwc(x, nchw)
    gy = _nhwc(gy, nchw)
    n, h, wd, c = x.shape
    _, oh, ow, f = gy.shape
    cg = c // groups
    fg = f // groups
    gy2 = gy.reshape(n * oh * ow, f)
    gw = np.empty((fh * fw * cg, f), x.dtype)
    for g in range(groups):
        if groups == 1 and _pointwise(fh, fw, sh, sw, ph, pw):
            cols = x.reshape(n * h * wd, c)
        else:
            cols = _im2col(x, g * cg, cg, fh, fw, sh, sw, ph, pw, dh, dw, oh, ow)
        gyg = np.ascontiguousarray(gy2[:, g * fg:(g + 1) * fg])
        gw[:, g * fg:(g + 1) * fg] = np.dot(np.ascontiguousarray(cols.T), gyg)
    gw4 = gw.reshape(fh, fw, cg, f)
    if nchw:
        return np.ascontiguousarray(gw4.transpose(3, 2, 0, 1))
    return gw4


@numba.njit(**_JIT)
def max_pool_forward(x, nchw, fh, fw, sh, sw, ph, pw):
    """Return the max over every window; padded cells never win."""
    x = _nhwc(x, nchw)
    n, h, w, c = x.shape
    oh = out_len(h, fh, sh, ph, 1)
    ow = out_len(w, fw, sw, pw, 1)
    out = np.empty((n, oh, ow, c), x.dtype)
    low = -np.inf
    for b in range(n):
        for oy in range(oh):
            for ox in range(ow):
                for k in range(c):
                    out[b, oy, ox, k] = low
                for i in range(fh):
                    iy = oy * sh - ph + i
                    if iy < 0 or iy >= h:
                        continue
                    for j in range(fw):
                        ix = ox * sw - pw + j
                        if ix < 0 or ix >= w:
                            continue
                        for k in range(c):
                            v = x[b, iy, ix, k]
                            if v > out[b, oy, ox, k]:
                                out[b, oy, ox, k] = v
    return _back(out, nchw)


@numba.njit(**_JIT)
def max_pool_grad(x, gy, nchw, fh, fw, sh, sw, ph, pw):
    """Return the gradient of max pooling: each window's gradient goes to its first maximum."""
    x = _nhwc(x, nchw)
    gy = _nhwc(gy, nchw)
    n, h, w, c = x.shape
    _, oh, ow, _ = gy.shape
    gx = np.zeros_like(x)
    best = np.empty(c, x.dtype)
    at = np.empty(c, np.int64)
    for b in range(n):
        for oy in range(oh):
            for ox in range(ow):
                best[:] = -np.inf
                at[:] = -1
                for i in range(fh):
                    iy = oy * sh - ph + i
                    if iy < 0 or iy >= h:
                        continue
                    for j in range(fw):
                        ix = ox * sw - pw + j
                        if ix < 0 or ix >= w:
                            continue
                        for k in range(c):
                            v = x[b, iy, ix, k]
                            if v > best[k]:
                                best[k] = v
                                at[k] = iy * w + ix
                for k in range(c):
                    if at[k] >= 0:
                        gx[b, at[k] // w, at[k] % w, k] += gy[b, oy, ox, k]
    return _back(gx, nchw)


@numba.njit(**_JIT)
def avg_pool_forward(x, nchw, fh, fw, sh, sw, ph, pw):
    """Return the mean over every window, padding counted as zeros."""
    x = _nhwc(x, nchw)
    n, h, w, c = x.shape
    oh = out_len(h, fh, sh, ph, 1)
    ow = out_len(w, fw, sw, pw, 1)
    out = np.zeros((n, oh, ow, c), x.dtype)
    scale = 1.0 / (fh * fw)
    for b in range(n):
        for oy in range(oh):
            for ox in range(ow):
                for i in range(fh):
                    iy = oy * sh - ph + i
                    if iy < 0 or iy >= h:
                        continue
                    for j in range(fw):
                        ix = ox * sw - pw + j
                        if ix < 0 or ix >= w:
                            continue
                        for k in range(c):
                            out[b, oy, ox, k] += x[b, iy, ix, k]
                for k in range(c):
                    out[b, oy, ox, k] *= scale
    return _back(out, nchw)


@numba.njit(**_JIT)
def avg_pool_grad(gy, nchw, h, w, fh, fw, sh, sw, ph, pw):
    """Return the gradient of average pooling for images of height ``h`` and width ``w``."""
    gy = _nhwc(gy, nchw)
    n, oh, ow, c = gy.shape
    gx = np.zeros((n, h, w, c), gy.dtype)
    scale = 1.0 / (fh * fw)
    for b in range(n):
        for oy in range(oh):
            for ox in range(ow):
                for i in range(fh):
                    iy = oy * sh - ph + i
                    if iy < 0 or iy >= h:
                        continue
                    for j in range(fw):
                        ix = ox * sw - pw + j
                        if ix < 0 or ix >= w:
                            continue
                        for k in range(c):
                            gx[b, iy, ix, k] += gy[b, oy, ox, k] * scale
    return _back(gx, nchw)


@numba.njit(**_JIT)
def bn_forward(x, gamma, beta, eps, groups):
    """Normalize the rows of ``x`` (rows, channels) in ``groups`` equal row groups.

    Returns ``(y, mean, var)``: the statistics are the groups' averages, per channel.
    """
    rows, c = x.shape
    if rows % groups:
        raise ValueError("batch norm: the rows do not split into n_groups equal groups")
    m = rows // groups
    y = np.empty_like(x)
    mean_all = np.zeros(c, x.dtype)
    var_all = np.zeros(c, x.dtype)
    mean = np.empty(c, np.float64)
    var = np.empty(c, np.float64)
    for g in range(groups):
        mean[:] = 0.0
        var[:] = 0.0
        for r in range(g * m, (g + 1) * m):
            for k in range(c):
                mean[k] += x[r, k]
        mean /= m
        for r in range(g * m, (g + 1) * m):
            for k in range(c):
                d = x[r, k] - mean[k]
                var[k] += d * d
        var /= m
        for k in range(c):
            mean_all[k] += mean[k] / groups
            var_all[k] += var[k] / groups
            # scale and shift folded into one multiply-add per element
            var[k] = gamma[k] / np.sqrt(var[k] + eps)
            mean[k] = beta[k] - mean[k] * var[k]
        for r in range(g * m, (g + 1) * m):
            for k in range(c):
                y[r, k] = x[r, k] * var[k] + mean[k]
    return y, mean_all, var_all


@numba.njit(**_JIT)
def bn_backward(x, gamma, gy, eps, groups):
    """Return ``(gx, ggamma, gbeta)`` of ``bn_forward``'s ``y`` for rows ``x`` and gradient ``gy``."""
    rows, c = x.shape
    if rows % groups:
        raise ValueError("batch norm: the rows do not split into n_groups equal groups")
    m = rows // groups
    gx = np.empty_like(x)
    ggamma = np.zeros(c, x.dtype)
    gbeta = np.zeros(c, x.dtype)
    mean = np.empty(c, np.float64)
    inv = np.empty(c, np.float64)
    sg = np.empty(c, np.float64)
    sgx = np.empty(c, np.float64)
    for g in range(groups):
        mean[:] = 0.0
        inv[:] = 0.0
        sg[:] = 0.0
        sgx[:] = 0.0
        for r in range(g * m, (g + 1) * m):
            for k in range(c):
                mean[k] += x[r, k]
        mean /= m
        for r in range(g * m, (g + 1) * m):
            for k in range(c):
                d = x[r, k] - mean[k]
                inv[k] += d * d
        for k in range(c):
            inv[k] = 1.0 / np.sqrt(inv[k] / m + eps)
        for r in range(g * m, (g + 1) * m):
            for k in range(c):
                sg[k] += gy[r, k]
                sgx[k] += gy[r, k] * (x[r, k] - mean[k]) * inv[k]
        for k in range(c):
            gbeta[k] += sg[k]
            ggamma[k] += sgx[k]
        for r in range(g * m, (g + 1) * m):
            for k in range(c):
                xhat = (x[r, k] - mean[k]) * inv[k]
                gx[r, k] = gamma[k] * inv[k] / m * (m * gy[r, k] - sg[k] - xhat * sgx[k])
    return gx, ggamma, gbeta
