"""Measuring tools, run from a source checkout with `python -m bench.<tool>` (not installed with the
package): bench, sweep, pass_cost, prefill_rate, prefill_timeline, compare_deepspeed, linkbench,
project (a cost-model projection), host_overhead. Results they write belong in results/, their
tables in docs/."""
