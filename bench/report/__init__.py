"""``make bench``'s report: every ``bench/results/*.md`` (and its plots) in one REPORT.md.

Run ``.venv/bin/python bench/report`` after the benchmarks. Benchmarks record their headline
numbers with :func:`report.headlines.write_headlines` (``bench/results/<name>.json``); the report
puts them in one table at the top, stamped with the machine and library versions.
"""
