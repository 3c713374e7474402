"""Whose a process is: the cookie, the evidence of birth, the session's census."""

