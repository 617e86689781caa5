"""The message plane: wire protocol, state-directory paths, logging set-up, the
broker process and the client side actors use. Imports nothing from `actors` or
`supervisor`."""
