"""Checking: one check as a pipeline, observe -> decide -> act, and what lasts between checks."""

