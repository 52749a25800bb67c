"""Residual designs behind one protocol (`Design`), and their registry; `model.stream.design` picks one.

A site is one residual connection: `site(carry, fn, norm_in, norm_out, chain_l) -> carry`, fn(x, xn, scale) =
scale·f(x) reading xn = norm_in(x) (scale None, or folded into f's last kernel; for an LM's attention xn may be a
normed (query, key, value) triple), norm_out the post-norm (identity for pre-norm; a ResNet's ReLU), chain_l this
layer's slice of the design's chain parameters (those whose init depends on the site index). Each design file
declares its config (a frozen dataclass, the section `model.<section>`) and registers its designs; one outside the
package does the same in its own module, named by import path `model.stream.design='module:name'`.
"""

# pylint: disable=wildcard-import,unused-wildcard-import
from laurel.designs.protocol import *  # noqa: F401,F403  # the protocol and the registry, as laurel.designs.<name>

# The families register themselves, in the order `model.stream.design` lists them.
from laurel.designs import laurel, scale, hyper, denseformer, attnres, mudd, dca  # noqa: E402,F401
