"""The benches' rows on an NVIDIA GPU (rows.py), and the script that runs them on a GPU machine (run.sh)."""
