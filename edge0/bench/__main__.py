"""`python -m edge0.bench mlx-lm PATH REPLAY DTYPE`: the mlx-lm arm, run in a process of its own by `edge0 bench`."""

import sys

from . import mlx_lm_arm

_, arm, path, replay_file, dtype = sys.argv
mlx_lm_arm(path, replay_file, dtype)
