"""The product's tasks: one module per job type (payload model, pure logic, thin task, typed enqueue)."""
