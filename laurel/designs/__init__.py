"""Residual designs behind one protocol (`Design`), and their registry; `model.stream.design` picks one.

A site is `site(carry, fn, norm_in, norm_out, chain_l) -> carry`: fn(x, xn, scale) = scale·f(x) reading xn =
norm_in(x) (for an LM's attention, maybe a normed (query, key, value) triple), norm_out the post-norm (identity for
pre-norm; a ResNet's ReLU), chain_l this layer's slice of the design's chain parameters. A design outside the package
registers in its own module, named `model.stream.design='module:name'`.
"""

# pylint: disable=wildcard-import,unused-wildcard-import
from laurel.designs.protocol import *  # noqa: F401,F403  # the protocol and the registry, as laurel.designs.<name>

# The families register themselves, in the order `model.stream.design` lists them.
from laurel.designs import laurel, scale, hyper, denseformer, attnres, mudd, dca  # noqa: E402,F401
