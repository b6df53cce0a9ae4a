"""The shared engine: PostgreSQL, for any number of stateless contextd replicas.

Everything replicas must agree on lives in the database and is changed in the
transaction of the write that changes it: message, event and context ids come from
PostgreSQL sequences; a thread's sequence numbers, counters and clear marker sit in its
row, which an append locks; request records are written with the write they record. A
replica caches nothing mutable. `tenant` leads every primary key and index and every query
names it, so a Citus deployment can distribute every table by tenant unchanged.
"""
