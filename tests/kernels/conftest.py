import os
import sys

# Helpers of one kernel test file that another imports by name (test_gluon_sparse_mla uses
# test_triton_sparse_mla's cases).
sys.path.insert(0, os.path.dirname(__file__))
