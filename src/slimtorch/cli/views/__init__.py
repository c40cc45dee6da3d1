"""How the command line draws each report (rich tables and charts); the reports themselves are plain data."""
