"""cache-dit-opd benchmarks (issue 7). Entry point: ``bench/run.sh`` (``python -m bench``); see bench/README.md."""
