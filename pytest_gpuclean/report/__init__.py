"""Formatting: terminal lines, the JSON report and its schema, what CI reads, the command's output."""

