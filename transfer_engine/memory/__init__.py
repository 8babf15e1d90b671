"""Memory: the KV layout and pool a rank hands the engine, views of memory serving systems own, and staging buffers."""
