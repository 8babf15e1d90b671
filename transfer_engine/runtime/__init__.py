"""The actor runtime: mail and mailboxes, ports, completion waiters, timers, the log book and step traces."""
