"""The worker's AMQP side: the I/O thread and its link, a channel per held queue, deliveries
into the buffer, acks, dead-letter and aside copies, and the starved-queue watch."""
