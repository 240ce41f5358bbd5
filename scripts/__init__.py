import os

# Before anything imports torch (every front end imports this package first): OpenMP threads that
# sleep while they wait instead of spinning, so a busy machine's cores are not fought over
# (scripts/defaults.py has the measurements).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
