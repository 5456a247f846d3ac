"""``python -m train.compare LOG...``: run logs of any devices into tables, scores and plots.

report    the command: read, score, write report.md and the plots
runs      reading run logs into comparable runs
scoring   the study's weighted score under its seven strategies
quality   the quality gate: a run that did not learn is never ranked
tables    the report's tables
plots     the report's figures
"""
