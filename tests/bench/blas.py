"""Which BLAS a LibTorch computes fp32 with, and what it costs: one
512 x 512 x 512 matmul on one thread, fp32 and under bf16 autocast (the
README's BLAS table). Run with each leg's Python:

    /usr/bin/python3 tests/bench/blas.py               # Debian's 1.13
    build/pip-venv/bin/python3 tests/bench/blas.py     # the pip leg's wheel
"""
import time

import torch

torch.set_num_threads(1)
blas = [line.strip() for line in torch.__config__.show().splitlines() if "BLAS_INFO" in line]
blas_info = blas[0].split("BLAS_INFO=")[1].split(",")[0] if blas else "?"
a, b = torch.randn(512, 512), torch.randn(512, 512)


def seconds(f, n=5):
    f()
    start = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - start) / n


fp32 = seconds(lambda: a @ b)
with torch.autocast("cpu", dtype=torch.bfloat16):
    bf16 = seconds(lambda: a @ b)
print(f"torch {torch.__version__}, BLAS_INFO={blas_info}: fp32 {fp32 * 1e3:.1f} ms "
      f"({2 * 512 ** 3 / fp32 / 1e9:.0f} GFLOP/s), bf16 autocast {bf16 * 1e3:.1f} ms, fp32/bf16 {fp32 / bf16:.1f}")
