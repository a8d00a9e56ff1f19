"""The configuration: the frozen tree the code reads and its loader (`tree`), one pydantic
model per section (`models`), the value types (`values`: durations, sizes, rates), and
`${CREDENTIALS_DIRECTORY}` in file keys (`credentials`)."""
