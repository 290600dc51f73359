"""What the front end and the ranks share: the messages between them, their codec, and the state of a request
that the ranks hold and hand to each other in a switch."""
