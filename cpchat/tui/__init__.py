"""The Textual front end: transcript, input, attachments and live rank panels."""
