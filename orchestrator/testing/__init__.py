"""What tests and benchmarks run the product with, and the product never imports (an
architecture test says so): the in-process island pool with its injected faults
(`pool`), failures in time (`chaos`), and a whole run in this process (`runner`)."""
