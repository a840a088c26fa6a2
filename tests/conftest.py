"""Test-session settings: one intra-op thread (tiny models; two threads thrash on a shared 2-core machine)."""

import os

import torch

torch.set_num_threads(int(os.environ.get("HF_CHAINFLOW_TEST_THREADS", "1")))
