"""Layer 8: measurements (`zerodist bench ...`). Benchmarks print ratios; they never fail on speed."""
