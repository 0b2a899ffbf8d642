"""The prefix cache's block events, published in vLLM's `--kv-events-config` format
(ZeroMQ PUB + msgpack) for external KV-aware routers (llm-d, Dynamo).

    publisher = KVEventPublisher(KVEventsConfig.from_json(text))
    publisher.publish(block_manager_log.drain(), block_size)   # each tick, never waits

config.py: the flag (no zmq: the CLI reads it); wire.py: the frames and their layout;
publisher.py: the queue, the thread and the sockets.
"""
