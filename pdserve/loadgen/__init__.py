"""`pdserve bench`: a client-side load generator for OpenAI-compatible endpoints.

Entry points: `run_benchmark(BenchConfig) -> BenchResult` (runner),
`format_report`/`write_json` (report) and `write_png` (plots). No torch here.
"""
