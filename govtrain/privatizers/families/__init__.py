"""The noise families (docs/privatizers.md, "Noise families"): Laplace (L1 clipping, pure ε), the discrete
Gaussian (exact Canonne–Kamath–Steinke sampler) and Skellam, each adding integer noise to clipped gradients
quantised onto a public lattice (`lattice.py`), each charged by its own accountant (`accounting.families`) and
held to its own floor in the policy (`floors.py`).

The registry (`govtrain.privatizers.REGISTRY`) imports each class from its own module; nothing here imports
torch at import time.
"""
