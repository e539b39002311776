"""Secure aggregation (docs/secure_aggregation.md): the server learns the sum of the clients'
vectors and nothing else.

- ``secagg``: SecAgg (Bonawitz et al., CCS 2017) and SecAgg+ (Bell et al., CCS 2020), pairwise
  masks from X25519 + HKDF + AES-CTR, Shamir shares of the mask seeds (``shamir``), stochastic
  quantization to Z_{2^32} (``quantize``);
- ``paillier``: additively homomorphic encryption (``phe``) with fixed-point slot packing and a
  key authority that decrypts only round aggregates; ``ckks``: TenSEAL's approximate CKKS.

Every protocol implements ``SecureSum`` (``base``): the engine's secure aggregation slot.
"""
