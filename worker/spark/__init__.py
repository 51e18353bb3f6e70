"""Spark: the session, the pipeline's job, the keyed fold run inside it, the Parquet sink, and
what makes a local Spark start and fork quickly."""
