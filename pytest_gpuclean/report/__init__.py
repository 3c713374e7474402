"""Reports: terminal lines, the JSON report, the session's records and their shipping between processes.
(Empty: importing a layer loads none of its modules.)"""

