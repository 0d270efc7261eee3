"""The wire protocol: the codec, client encodings, the session's message handling, cursors and COPY,
transactions and the extended protocol."""
