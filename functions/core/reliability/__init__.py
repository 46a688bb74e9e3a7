"""Nothing lost: dead letters redriven or held as poison, and the exactly-once audit."""
