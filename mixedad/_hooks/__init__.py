"""Every place where mixedad reaches into PyTorch's private API or patches a torch object.

One module per hook. Each module's docstring states the torch behaviour it relies on, and
``tests/_hooks/`` pins each of those assumptions with a test named after the hook, so that a
torch upgrade that moves one of them fails one named test instead of giving a wrong number
somewhere far away. Nothing here runs at import time that assumes torch's internals: patches
are resolved and installed when a pass first needs them, and removed when the last one ends
(:mod:`mixedad._hooks.refcount`).

The rest of mixedad imports torch internals only through this package.
"""
