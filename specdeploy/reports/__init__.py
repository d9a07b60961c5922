"""Measuring: the bench grid runner, the analytic model, plots and reports, Prometheus metrics.

Everything here consumes the runtime's per-cycle records; the decoder knows no sink.
"""
