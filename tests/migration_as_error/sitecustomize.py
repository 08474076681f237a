"""Put this folder first on PYTHONPATH and every Python process started with it (an example, the processes it
launches) raises `deepepochs.MigrationWarning` as an error. Python's own `-W error::deepepochs.MigrationWarning`
cannot: it resolves the category before the interpreter can import the package, and ignores the option."""

import warnings

from deepepochs.errors import MigrationWarning

warnings.simplefilter("error", MigrationWarning)
