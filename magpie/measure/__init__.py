"""Measurement: decode bench, GSM8K, sweep, profile capture and trace split, log check, report."""
