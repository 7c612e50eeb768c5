"""Training: the rollout store shared by every trainer, SFT, and the methods' own trainers.

Everything here needs the ``train`` extra (``pip install 'sleuth[train]'``: TRL, PEFT, datasets) except the
rollout store, which only reads and writes Traces.
"""
