"""Checks jaxring's CUDA reduce kernels (JaxringCudaReduce in xla_ffi/cuda/reduce_kernels.cu)
bit for bit against numpy: every op x dtype, 1..16 operands, one and several targets, aligned and
misaligned pointers (the 16-byte vector path and the scalar path), awkward counts, NaNs.

    python tests/gpu_kernels_check.py [--quick]
    compute-sanitizer --tool memcheck python tests/gpu_kernels_check.py --quick   # (and racecheck)

tests/test_gpu.py runs it under compute-sanitizer. Needs a GPU; exits 2 with a message otherwise.
"""

from __future__ import annotations

import argparse
import ctypes
import sys

import jax
import jax.numpy as jnp
import numpy as np

jax.config.update("jax_enable_x64", True)  # int64 and float64 buffers stay 64-bit

from jaxring._src.common import DTYPE_CODES as DTYPES  # noqa: E402 (after x64 is enabled)
from jaxring._src.common import REDUCE_OPS as OPS  # noqa: E402


def expected(sources: list[np.ndarray], op: str, divisor: int) -> np.ndarray:
    """The kernel's arithmetic: in order over operands, 16-bit types in float32, rounded once."""
    dtype = sources[0].dtype
    acc_type = np.float32 if dtype.itemsize == 2 and dtype.kind != "i" else dtype
    acc = sources[0].astype(acc_type)
    for s in sources[1:]:
        b = s.astype(acc_type)
        if op in ("sum", "mean"):
            acc = acc + b
        else:
            pick = np.maximum if op == "max" else np.minimum
            nan_a = np.isnan(acc) if acc.dtype.kind == "f" else np.zeros(acc.shape, bool)
            acc = np.where(nan_a, acc, pick(acc, b))  # NaN wins, the first one seen
    if op == "mean" and divisor > 0:
        if acc.dtype.kind == "i":
            acc = np.sign(acc) * (np.abs(acc) // divisor)  # C++ division truncates
        else:
            acc = acc / acc.dtype.type(divisor)
    return acc.astype(dtype)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer sizes (for the sanitizers)")
    args = parser.parse_args()
    try:
        gpu = jax.devices("cuda")[0]
    except RuntimeError:
        print("no CUDA GPU visible: nothing to check", file=sys.stderr)
        return 2
    from jaxring._src import native

    library = native.cuda_library()
    library.JaxringCudaReduce.restype = ctypes.c_int
    library.JaxringCudaReduce.argtypes = [
        ctypes.c_uint8, ctypes.c_uint8, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
        ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
        ctypes.c_void_p]
    cudart = ctypes.CDLL("libcudart.so.13")  # already loaded by JAX's CUDA plugin
    rng = np.random.default_rng(0)
    counts = [0, 1, 7, 9, 1000, 65_537] if args.quick else [0, 1, 7, 8, 9, 1000, 65_537,
                                                             (1 << 20) + 3]
    few_operands = [1, 2, 3, 16]
    operand_counts = few_operands if args.quick else list(range(1, 17))
    # The full check ran past 150 s on an H100. Most of its data was the largest count under
    # every operand count, so that count now runs with a few operand counts, the others with all.
    large = 1 << 20
    checked = 0
    for dtype, code in DTYPES.items():
        for op, op_code in OPS.items():
            for n in operand_counts:
                for count in counts:
                    if count > large and n not in few_operands:
                        continue
                    for offset in (0, 1):  # 1: every pointer one element off 16-byte alignment
                        for targets in (1, 3):
                            # One element more than the kernel may touch: it must stay 0.
                            length = offset + count + 1
                            host = []
                            for k in range(n):
                                if dtype.kind == "i":
                                    v = rng.integers(-1000, 1000, length).astype(dtype)
                                else:
                                    v = rng.standard_normal(length).astype(dtype)
                                    if count > 5 and op in ("max", "min"):
                                        # A NaN in one operand only, at an element of its own
                                        # (the last operand's too): fmaxf/fminf would drop it.
                                        v[offset + k % (count - 1)] = np.nan
                                        v[offset + count - 1] = np.nan if k == n - 1 else 1.0
                                host.append(v)
                            srcs = [jax.device_put(v, gpu) for v in host]
                            dsts = [jnp.zeros(length, dtype, device=gpu)
                                    for _ in range(targets)]
                            for a in srcs + dsts:
                                a.block_until_ready()
                            w = dtype.itemsize * offset
                            src_ptrs = (ctypes.c_void_p * n)(
                                *[a.unsafe_buffer_pointer() + w for a in srcs])
                            dst_ptrs = (ctypes.c_void_p * targets)(
                                *[a.unsafe_buffer_pointer() + w for a in dsts])
                            divisor = n if op == "mean" else 0
                            error = library.JaxringCudaReduce(code, op_code, src_ptrs, n,
                                                              dst_ptrs, targets, count, divisor,
                                                              None)
                            assert error == 0, f"launch failed: CUDA error {error}"
                            assert cudart.cudaDeviceSynchronize() == 0
                            want = expected([v[offset:offset + count] for v in host], op,
                                            divisor)
                            case = (f"{dtype} {op} n={n} count={count} offset={offset} "
                                    f"targets={targets}")
                            for d in dsts:
                                got = np.asarray(d)
                                # float32 holds every 16-bit float, and numpy's NaN-aware
                                # comparison knows float32 (not bfloat16).
                                wide = np.float32 if dtype.itemsize == 2 and dtype.kind != "i" \
                                    else dtype
                                np.testing.assert_array_equal(
                                    got[offset:offset + count].astype(wide), want.astype(wide),
                                    err_msg=case)
                                untouched = np.concatenate([got[:offset], got[offset + count:]])
                                assert not untouched.astype(np.float64).any(), \
                                    f"wrote outside its range: {case}"
                            checked += 1
    # Too many operands is refused, not run.
    too_many = (ctypes.c_void_p * 17)()
    one = (ctypes.c_void_p * 1)()
    assert library.JaxringCudaReduce(11, 0, too_many, 17, one, 1, 4, 0, None) != 0
    print(f"kernels agree with numpy ({checked} cases)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
