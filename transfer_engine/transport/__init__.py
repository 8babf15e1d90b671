"""The NIXL transport behind a narrow interface, and a fault-injecting wrapper for tests."""
