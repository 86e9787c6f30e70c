"""ctypes view of the CPU kernel library (libzerod_kernels.so) for tests.

Only what the tests call is declared. The library path comes from
$ZEROD_KERNELS_LIB, which ctest sets to the library it just built.
"""
import ctypes
import os

import numpy as np

F32, BF16, F16, NONE = 0, 1, 2, 3


class AdamHparams(ctypes.Structure):
    _fields_ = [
        ("lr", ctypes.c_double),
        ("beta1", ctypes.c_double),
        ("beta2", ctypes.c_double),
        ("eps", ctypes.c_double),
        ("weight_decay", ctypes.c_double),
        ("decoupled_weight_decay", ctypes.c_int),
        ("step", ctypes.c_int64),
        ("grad_scale", ctypes.c_double),
        ("v_frozen_at", ctypes.c_int64),
    ]


class SgdHparams(ctypes.Structure):
    _fields_ = [
        ("lr", ctypes.c_double),
        ("momentum", ctypes.c_double),
        ("dampening", ctypes.c_double),
        ("weight_decay", ctypes.c_double),
        ("nesterov", ctypes.c_int),
        ("step", ctypes.c_int64),
        ("grad_scale", ctypes.c_double),
    ]


def _ptr(array):
    if array is None:
        return None
    assert array.flags["C_CONTIGUOUS"]
    return ctypes.c_void_p(array.ctypes.data)


class Kernels:
    def __init__(self, threads=2):
        path = os.environ.get("ZEROD_KERNELS_LIB")
        if not path:
            raise RuntimeError("ZEROD_KERNELS_LIB is not set (run through ctest or make test)")
        self.lib = ctypes.CDLL(path)
        self.lib.zk_pool_create.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_void_p)]
        self.lib.zk_pool_destroy.argtypes = [ctypes.c_void_p]
        self.lib.zk_adam_step.argtypes = [ctypes.c_void_p, ctypes.POINTER(AdamHparams)] + [
            ctypes.c_void_p] * 4 + [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
        self.lib.zk_sgd_step.argtypes = [ctypes.c_void_p, ctypes.POINTER(SgdHparams)] + [
            ctypes.c_void_p] * 3 + [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
        self.lib.zk_onebit_bytes.argtypes = [ctypes.c_size_t, ctypes.c_size_t]
        self.lib.zk_onebit_bytes.restype = ctypes.c_size_t
        self.lib.zk_onebit_encode.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                                              ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                                              ctypes.c_size_t]
        self.lib.zk_onebit_decode.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                                              ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t]
        sz, vp = ctypes.c_size_t, ctypes.c_void_p
        self.lib.zk_lowrank_project.argtypes = [vp, vp, sz, sz, vp, sz, vp]
        self.lib.zk_lowrank_back.argtypes = [vp, vp, sz, sz, vp, sz, vp]
        self.lib.zk_lowrank_orthonormalize.argtypes = [vp, vp, sz, sz]
        self.lib.zk_lowrank_expand.argtypes = [vp, vp, vp, sz, sz, sz, sz, vp, ctypes.c_int]
        self.pool = ctypes.c_void_p()
        rc = self.lib.zk_pool_create(threads, ctypes.byref(self.pool))
        if rc != 0:
            raise OSError(-rc, "zk_pool_create failed")

    def close(self):
        self.lib.zk_pool_destroy(self.pool)

    def adam_step(self, hp, param, exp_avg, exp_avg_sq, grad, grad_dtype, working=None,
                  working_dtype=NONE):
        rc = self.lib.zk_adam_step(self.pool, ctypes.byref(hp), _ptr(param), _ptr(exp_avg),
                                   _ptr(exp_avg_sq), _ptr(grad), grad_dtype, _ptr(working),
                                   working_dtype, param.size)
        if rc != 0:
            raise OSError(-rc, "zk_adam_step failed")

    def sgd_step(self, hp, param, momentum_buf, grad, grad_dtype, working=None,
                 working_dtype=NONE):
        rc = self.lib.zk_sgd_step(self.pool, ctypes.byref(hp), _ptr(param), _ptr(momentum_buf),
                                  _ptr(grad), grad_dtype, _ptr(working), working_dtype,
                                  param.size)
        if rc != 0:
            raise OSError(-rc, "zk_sgd_step failed")


    def onebit_encode(self, block, x, error):
        """Encodes x + error (error updated in place); returns the bytes."""
        out = np.zeros(self.lib.zk_onebit_bytes(block, x.size), dtype=np.uint8)
        rc = self.lib.zk_onebit_encode(self.pool, block, _ptr(x), _ptr(error), x.size, _ptr(out),
                                       out.size)
        if rc != 0:
            raise OSError(-rc, "zk_onebit_encode failed")
        return out

    def onebit_decode(self, block, data, numel):
        y = np.empty(numel, dtype=np.float32)
        rc = self.lib.zk_onebit_decode(self.pool, block, _ptr(data), data.size, _ptr(y), numel)
        if rc != 0:
            raise OSError(-rc, "zk_onebit_decode failed")
        return y

    def lowrank_project(self, M, Q):
        """P = M Q (zk_lowrank_project) for M rows x cols, Q cols x rank."""
        rows, cols = M.shape
        P = np.empty((rows, Q.shape[1]), dtype=np.float32)
        rc = self.lib.zk_lowrank_project(self.pool, _ptr(M), rows, cols, _ptr(Q), Q.shape[1],
                                         _ptr(P))
        if rc != 0:
            raise OSError(-rc, "zk_lowrank_project failed")
        return P

    def lowrank_back(self, M, P):
        """Q = M^T P (zk_lowrank_back) for M rows x cols, P rows x rank."""
        rows, cols = M.shape
        Q = np.empty((cols, P.shape[1]), dtype=np.float32)
        rc = self.lib.zk_lowrank_back(self.pool, _ptr(M), rows, cols, _ptr(P), P.shape[1],
                                      _ptr(Q))
        if rc != 0:
            raise OSError(-rc, "zk_lowrank_back failed")
        return Q

    def lowrank_orthonormalize(self, P):
        """Gram-Schmidt on the columns of P (rows x rank), in place."""
        rc = self.lib.zk_lowrank_orthonormalize(self.pool, _ptr(P), P.shape[0], P.shape[1])
        if rc != 0:
            raise OSError(-rc, "zk_lowrank_orthonormalize failed")

    LOWRANK_MODES = {"set": 0, "add": 1, "subtract": 2}

    def lowrank_expand(self, P, Q, numel, out, mode="set"):
        """The first numel elements of P Q^T into out (flat fp32, updated in
        place) by mode: "set", "add" or "subtract"."""
        rc = self.lib.zk_lowrank_expand(self.pool, _ptr(P), _ptr(Q), P.shape[0], Q.shape[0],
                                        P.shape[1], numel, _ptr(out), self.LOWRANK_MODES[mode])
        if rc != 0:
            raise OSError(-rc, "zk_lowrank_expand failed")


def empty(n, dtype=np.float32):
    return np.empty(n, dtype=dtype)
