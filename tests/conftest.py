import os

# Tests talk to local Ray clusters without token auth, and never wait long for workers.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "30")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
