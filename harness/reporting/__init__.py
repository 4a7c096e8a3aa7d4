"""Reporting: report.md / report.html, figures, and the results API that loads run folders
into pandas."""
