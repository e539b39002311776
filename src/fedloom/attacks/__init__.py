"""Poisoning attacks (docs/security.md): a seeded fraction of malicious clients
(``selection``) poison their training data (``data``: label flipping, random labels, a
pixel-trigger backdoor) or their uploads (``updates``: Gaussian noise, scaling, sign flipping).
"""
