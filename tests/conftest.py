import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
# models written the way other code bases write them (benchmarks/others.py)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
