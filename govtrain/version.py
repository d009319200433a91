"""govtrain's version, in a module below every other: a layer that records it (a release's govtrain.json, the ranks'
agreement) reads it here, never through the root package, which would put that layer in a circle with everything the
root loads on first use."""

__version__ = "0.1.0"
