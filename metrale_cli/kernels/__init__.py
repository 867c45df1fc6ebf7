"""Kernels: the contract (ops.py), torch references, the CUDA registry, loader and checks.

``registry`` names every kernel (``module::function``), ``compile`` checks them on a CPU,
``loader`` + ``cuda_ops`` run them through CuPy, ``requirements`` says which ones each
KV-cache dtype needs and ``validate`` backs ``metrale validate-kernels``.
"""
