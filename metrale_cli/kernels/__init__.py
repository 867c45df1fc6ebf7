"""Kernels: the contract (ops.py), torch references, the CUDA registry, loader and checks.

``registry`` names every kernel (``module::function``) and builds the KV-dtype modules from
``kv/dtypes.KV_DTYPES``; ``kv_kernels`` says which kernels a dtype has at a head_dim (required,
launched, validated, served); ``compile`` checks them on a CPU; ``loader`` + ``cuda_ops`` +
``cuda_attention`` run them through CuPy; ``requirements`` is the start-up check and ``validate``
backs ``metrale validate-kernels``.
"""
