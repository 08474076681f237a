"""The typed spec of the deepepochs training loop (not shipped in the wheel); see `spec/loop.py`."""
