"""`tandem.parallel.compression` is now `tandem.parallel.data_parallel.compression`.

This path keeps working: importing it gives the same module object.
"""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("tandem.parallel.data_parallel.compression")
