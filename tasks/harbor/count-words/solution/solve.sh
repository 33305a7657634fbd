#!/bin/bash
wc -w < /app/notes.txt | tr -d ' ' > /app/answer.txt
